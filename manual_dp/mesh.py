"""An N-D device mesh: the contexts laid out as a grid whose dimensions are kinds of parallelism.

    dp   data: replicas of everything, each on its share of the batch; gradients all-reduced
    pp   pipeline: runs of layers (stages), activations sent forwards, gradients backwards
    cp   context: the sequence cut into blocks; attention joins them (ring or all-to-all)
    ep   expert: an MoE's experts sharded, the rest replicated (its ranks data parallel too: each
         takes its own rows); all-to-alls send each expert's slots to its rank and back
    tp   tensor: every split layer's weights cut (Megatron's f and g join the shards)

`--mesh dp=2,tp=2` on 4 contexts: rank r (ctx[r]) has coordinates that count in that order, tp
fastest: the contexts of a tensor group are neighbours, as clusters put tensor parallelism inside
a node, and data parallelism outermost, where a job grows across processes (torchtitan's and
Megatron's order, tp-cp-pp-dp from the inside out). A group of dimension `dim` is the ranks that
agree on every other coordinate: each collective of that kind of parallelism runs over one group.

The modes of the command line are meshes: sync dp=N, tensor dp=N/T x tp=T, hybrid dp=N/S x pp=S,
model and pipeline pp=N, context dp=N/C x cp=C (or dp x cp x tp with --tensor-parallel), mesh dp x
pp x tp (Megatron's 3-D), dp x pp x cp or dp x pp x cp x tp, expert dp=N/E x ep=E: each mode's entry
in manual_dp/modes.py says which mesh it lays out (`grid`) and which --mesh shapes it is (`shapes`).
"""
import math
from dataclasses import dataclass

DIMS = ("dp", "pp", "cp", "ep", "tp")       # outermost first
KINDS = {"dp": "data", "pp": "pipeline", "cp": "context", "ep": "expert", "tp": "tensor"}
COLLECTIVES = {"dp": "gradient all-reduce", "pp": "activations and gradients sent stage to stage",
               "cp": "attention's ring (key and value blocks) or all-to-all (Ulysses)",
               "ep": "all-to-alls of the experts' slots and outputs; every gradient but the experts' all-reduced",
               "tp": "Megatron's f and g (all-reduces; with --sequence-parallel all-gathers and reduce-scatters)"}
FIXED = {"dp": "pieces of the batch, their gradients added in --deterministic's one tree",   # --deterministic's sums
         "tp": "Megatron's f and g, the partial products of --tensor-pieces' pieces added in one fixed tree"}


@dataclass(frozen=True)
class Mesh:
    """Sizes of the five dimensions (DIMS orders them, outermost first); 1 for a dimension not used."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def parse(cls, text, n_contexts):
        """The mesh of "dp=D,tp=T,..." (any subset, any order) over `n_contexts`; ValueError (one
        line) for an unknown or repeated dimension, a size that is not a positive whole number,
        or sizes whose product is not the number of contexts."""
        sizes = {}
        for part in str(text).split(","):
            name, eq, value = part.strip().partition("=")
            if name not in DIMS or not eq:
                raise ValueError(f"--mesh {text}: each part is NAME=SIZE with NAME one of {', '.join(DIMS)}")
            if name in sizes:
                raise ValueError(f"--mesh {text}: {name} given twice")
            if not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"--mesh {text}: {name}={value} is not a positive whole number")
            sizes[name] = int(value)
        mesh = cls(**sizes)
        if mesh.size != n_contexts:
            raise ValueError(f"--mesh {text} multiplies to {mesh.size} contexts, not the {n_contexts} "
                             f"this run has")
        return mesh

    @property
    def shape(self):
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def size(self):
        return math.prod(self.shape)

    def used(self):
        """The dimensions of size > 1 (dp alone if none is)."""
        return [d for d in DIMS if getattr(self, d) > 1] or ["dp"]

    def coords(self, rank):
        """{dim: coordinate} of `rank`, tp counting fastest."""
        out = {}
        for d in reversed(DIMS):
            rank, out[d] = divmod(rank, getattr(self, d))
        return {d: out[d] for d in DIMS}

    def rank(self, **coords):
        """The rank at `coords` (missing dimensions: 0)."""
        r = 0
        for d in DIMS:
            r = r * getattr(self, d) + coords.get(d, 0)
        return r

    def groups(self, dim):
        """The groups of `dim`: lists of ranks that differ only in their `dim` coordinate, in order."""
        out = {}
        for r in range(self.size):
            key = tuple(v for d, v in self.coords(r).items() if d != dim)
            out.setdefault(key, []).append(r)
        return list(out.values())

    def __str__(self):
        return " x ".join(f"{d}={getattr(self, d)}" for d in self.used())

    def describe(self, ctx, processes=1, deterministic=False):
        """Lines for a run's header: the mesh, the coordinates of each context, and, per
        dimension used, its groups and the collective that runs over each (one line for a mesh of
        one dimension); `deterministic`: the sums as --deterministic fixes them. Across
        `processes`, data parallelism spans them: the mesh is each one's."""
        names = [str(c) for c in ctx]
        collectives = dict(COLLECTIVES, **FIXED) if deterministic else COLLECTIVES
        used = self.used()
        across = f"; dp also spans the {processes} processes" if processes > 1 else ""
        if len(used) == 1:
            group = "[" + " ".join(names) + "]"
            return [f"mesh {self} ({KINDS[used[0]]}): {group}, {collectives[used[0]]}{across}"]
        lines = [f"mesh {self} over {len(ctx)} contexts (outermost first; "
                 + ", ".join(f"{d}: {KINDS[d]}" for d in used) + ")" + across]
        lines.append("  " + ", ".join(f"{names[r]} ({' '.join(f'{d}{self.coords(r)[d]}' for d in used)})"
                                      for r in range(self.size)))
        for d in used:
            groups = " ".join("[" + " ".join(names[r] for r in g) + "]" for g in self.groups(d))
            lines.append(f"  {d} groups {groups}: {collectives[d]}")
        return lines
