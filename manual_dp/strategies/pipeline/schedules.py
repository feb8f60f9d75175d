"""Pipeline schedules as data: per device, the ordered actions (phase, stage, micro-batch) it runs;
a time simulation of them; the bubble and the micro-batches each device holds.

GPipe runs every forward (F) first, then every backward (B): each stage holds all M micro-batches.
1F1B (PipeDream-flush) lets stage s run S - 1 - s forwards ahead, then alternates one F and one B:
at most S - s held, the same bubble. Interleaved 1F1B (Narayanan et al. 2021, Megatron) cuts the
model into S*V stages, stage k on device k % S: V chunks a device, a bubble V times smaller.
ZB-H1 (Qi et al. 2024) splits the backward into B, the gradient the previous stage waits for, and
W, the weight gradient nothing waits for; put-off W's fill 1F1B's gaps. Each stage keeps as many
micro-batches as 1F1B until B (S - s), and S until W: the paper's "1F1B's peak" is stage 0's.

An action needs: F of stage k the F of stage k - 1 (same micro-batch); B of stage k its own F and
the B of stage k + 1; W its own B. `simulate` starts each action when its device is free and what
it needs has finished (transfers take no time), and refuses an order that never finishes.
"""
from dataclasses import dataclass
from typing import Tuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
Action = Tuple[str, int, int]      # (phase "F" | "B" | "W", stage, micro-batch)


@dataclass(frozen=True)
class Plan:
    """A schedule for `n_devices` devices, `n_micro` micro-batches and `virtual` stages a device
    (stage k on device k % n_devices): orders[d] is device d's actions, in the order it runs them."""
    name: str
    n_devices: int
    n_micro: int
    virtual: int
    orders: Tuple[Tuple[Action, ...], ...]

    @property
    def n_stages(self):
        return self.n_devices * self.virtual

    @property
    def split(self):
        """True if the backward is split into B and W."""
        return any(p == "W" for order in self.orders for p, _, _ in order)


def check_name(name, n_devices, n_micro, virtual=1):
    """Refuses, in one line, a schedule that is unknown or whose V does not fit."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose from {', '.join(SCHEDULES)}")
    if virtual < 1 or (virtual > 1 and name != "interleaved"):
        raise ValueError(f"{virtual} virtual stages a device need the interleaved schedule, not {name!r}")
    if n_devices < 1 or n_micro < 1:
        raise ValueError(f"a schedule needs at least one device and one micro-batch, not {n_devices} and {n_micro}")


def gpipe_schedule(n_stages, n_micro):
    """GPipe's clock ticks in closed form: each a list of (phase, stage, micro-batch) run side by side.

    All forwards first (stage s runs micro-batch m at tick s + m), then all backwards in
    reverse (the last stage starts with the last micro-batch, each stage one tick behind the next).
    """
    forward = [[("F", s, t - s) for s in range(n_stages) if 0 <= t - s < n_micro]
               for t in range(n_micro + n_stages - 1)]
    backward = [[("B", s, n_micro - 1 - (t - (n_stages - 1 - s))) for s in reversed(range(n_stages))
                 if 0 <= t - (n_stages - 1 - s) < n_micro]
                for t in range(n_micro + n_stages - 1)]
    return forward + backward


def one_f_one_b(forwards, backwards, warm):
    """`warm` forwards, then one forward one backward while forwards last, then the backwards left."""
    warm = min(warm, len(forwards))
    order = list(forwards[:warm])
    for f, b in zip(forwards[warm:], backwards):
        order += [f, b]
    return order + list(backwards[len(forwards) - warm:])


def stage_orders(name, n_stages, n_micro):
    """Per stage, the (phase, micro-batch) sequence of "gpipe" or "1f1b" (one stage a device)."""
    check_name(name, n_stages, n_micro)
    if name not in ("gpipe", "1f1b"):
        raise ValueError(f"stage_orders is for gpipe and 1f1b; use plan({name!r}, ...)")
    F, B = [("F", m) for m in range(n_micro)], [("B", m) for m in range(n_micro)]
    if name == "gpipe":
        return [F + B[::-1] for _ in range(n_stages)]
    return [one_f_one_b(F, B, n_stages - 1 - s) for s in range(n_stages)]


def interleaved_orders(S, M, V):
    """Megatron's interleaved 1F1B, per device d: the forwards run through groups of S micro-batches
    chunk by chunk (micro-batches 0..S-1 on chunk 0, then on chunk 1, ..., then the next group; a
    last group of M % S runs the same way), the backwards the same with the chunks reversed;
    2 (S - 1 - d) + (V - 1) S forwards run ahead, then one F one B, then the backwards left."""
    table = []                                       # (micro-batch, chunk) in forward order
    for lo in range(0, M, S):
        table += [(m, c) for c in range(V) for m in range(lo, min(lo + S, M))]
    orders = []
    for d in range(S):
        forwards = [("F", c * S + d, m) for m, c in table]
        backwards = [("B", (V - 1 - c) * S + d, m) for m, c in table]
        orders.append(one_f_one_b(forwards, backwards, 2 * (S - 1 - d) + (V - 1) * S))
    return orders


def zb_h1_orders(S, M):
    """ZB-H1 per stage s: 1F1B's S - 1 - s forwards ahead, then F and B for each further micro-batch,
    each B followed by the W of the micro-batch s places behind (stage s puts off s W's), then the
    cool-down's B's each followed by the oldest W left, then the W's left. So the B's the previous
    stage waits for run as in 1F1B, and the put-off W's fill the gaps 1F1B leaves idle."""
    orders = []
    for s in range(S):
        warm = min(S - 1 - s, M)
        order, waiting = [("F", s, m) for m in range(warm)], []
        for m in range(M):
            order += ([("F", s, warm + m)] if warm + m < M else []) + [("B", s, m)]
            waiting.append(m)
            if len(waiting) > s or warm + m >= M:
                order.append(("W", s, waiting.pop(0)))
        orders.append(order + [("W", s, m) for m in waiting])
    return orders


def check_micro(name, n_devices, n_micro):
    """Interleaved deadlocks for some M above S that S does not divide (as Megatron, it asks for a
    multiple of S); fewer micro-batches than devices run."""
    if name == "interleaved" and n_micro > n_devices and n_micro % n_devices:
        lo = n_micro - n_micro % n_devices
        raise ValueError(f"interleaved needs the micro-batches ({n_micro}) to be a multiple of the {n_devices} "
                         f"devices: pick {lo} or {lo + n_devices}")


def plan(name, n_devices, n_micro, virtual=1):
    """The Plan of schedule `name`: "gpipe", "1f1b", "interleaved" (`virtual` chunks a device) or "zb-h1"."""
    check_name(name, n_devices, n_micro, virtual)
    check_micro(name, n_devices, n_micro)
    if name == "interleaved":
        orders = interleaved_orders(n_devices, n_micro, virtual)
    elif name == "zb-h1":
        orders = zb_h1_orders(n_devices, n_micro)
    else:
        orders = [[(p, s, m) for p, m in order] for s, order in enumerate(stage_orders(name, n_devices, n_micro))]
    return Plan(name, n_devices, n_micro, virtual, tuple(map(tuple, orders)))


def needs(action, n_stages):
    """The actions `action` waits for (see the module's docstring)."""
    phase, k, m = action
    if phase == "F":
        return [("F", k - 1, m)] if k else []
    if phase == "B":
        return [("F", k, m)] + ([("B", k + 1, m)] if k < n_stages - 1 else [])
    return [("B", k, m)]


def label(action):
    phase, k, m = action
    return f"{phase} of stage {k}, micro-batch {m}"


def check_actions(p):
    """Refuses a plan in which an action is on the wrong device, or runs twice, or never."""
    phases = "FBW" if p.split else "FB"
    seen = set()
    for d, order in enumerate(p.orders):
        for a in order:
            if a[0] not in phases or not (0 <= a[1] < p.n_stages and 0 <= a[2] < p.n_micro):
                raise ValueError(f"schedule {p.name}: no such action as {a} "
                                 f"({p.n_stages} stages, {p.n_micro} micro-batches)")
            if a[1] % p.n_devices != d:
                raise ValueError(f"schedule {p.name}: {label(a)} is on device {d}, not {a[1] % p.n_devices}")
            if a in seen:
                raise ValueError(f"schedule {p.name}: {label(a)} runs twice")
            seen.add(a)
    for a in ((ph, k, m) for m in range(p.n_micro) for k in range(p.n_stages) for ph in phases):
        if a not in seen:
            raise ValueError(f"schedule {p.name}: {label(a)} never runs")


def unit_durations(p):
    """F = B = W = 1; a backward not split into B and W costs both: 2."""
    return {"F": 1.0, "B": 1.0, "W": 1.0} if p.split else {"F": 1.0, "B": 2.0}


def cost(durations, action):
    """The duration of `action`: durations[(phase, stage)] if given, else durations[phase]."""
    return durations.get(action[:2], durations.get(action[0]))


def simulate(p, durations=None):
    """{action: (start, end)}: each device runs its order, each action starting when the device is
    free and what it needs has ended. Raises ValueError naming an action that can never start
    (refuse_stuck), before anything runs. durations: see `cost` (default unit_durations)."""
    check_actions(p)
    durations = durations or unit_durations(p)
    pos, free, times, moved = [0] * p.n_devices, [0.0] * p.n_devices, {}, True
    while moved:
        moved = False
        for d, order in enumerate(p.orders):
            while pos[d] < len(order) and all(x in times for x in needs(order[pos[d]], p.n_stages)):
                a = order[pos[d]]
                start = max([free[d]] + [times[x][1] for x in needs(a, p.n_stages)])
                times[a] = (start, start + cost(durations, a))
                free[d], pos[d], moved = start + cost(durations, a), pos[d] + 1, True
    if any(i < len(order) for i, order in zip(pos, p.orders)):
        refuse_stuck(p, pos, times)
    return times


def refuse_stuck(p, pos, times):
    """Raises ValueError for the action that blocks: following what each stuck action waits for,
    from the lowest stuck device, the first that waits on its own device or closes a cycle."""
    d = next(i for i, order in enumerate(p.orders) if pos[i] < len(order))
    seen = []
    while d not in seen:
        seen.append(d)
        a = p.orders[d][pos[d]]
        w = next(x for x in needs(a, p.n_stages) if x not in times)
        if w[1] % p.n_devices == d:
            raise ValueError(f"schedule {p.name}: {label(a)} on device {d} waits for {label(w)}, which runs "
                             f"later on the same device: a bad order")
        d = w[1] % p.n_devices
    a = p.orders[d][pos[d]]
    w = next(x for x in needs(a, p.n_stages) if x not in times)
    raise ValueError(f"schedule {p.name}: {label(a)} on device {d} waits for {label(w)}, which device "
                     f"{w[1] % p.n_devices} runs only after another wait on this one: a deadlock")


def run_order(p):
    """Every action of plan p in one sequence that respects what each needs: by simulated start."""
    times = simulate(p)
    return sorted(times, key=lambda a: (times[a][0], a[1] % p.n_devices))


def bubbles(p, times, durations=None):
    """(idle share, bubble ratio) over the makespan: idle device time over all device time, and
    idle device time over busy device time (the papers' convention: bubble over ideal compute)."""
    durations = durations or unit_durations(p)
    span = max(end for _, end in times.values()) - min(start for start, _ in times.values())
    busy = sum(cost(durations, a) for a in times)
    idle = p.n_devices * span - busy
    return idle / (p.n_devices * span), idle / busy


def formula(p):
    """The papers' bubble over ideal compute, for unit durations: (p-1)/m for GPipe and 1F1B,
    (p-1)/(v m) interleaved, (p-1)(F+B-W)/(m(F+B+W)) = (p-1)/(3m) for ZB-H1. The simulation
    matches them exactly for M >= S (M a multiple of S interleaved); ZB-H1's assumes M >= S: with
    fewer, nothing is left to put off and its bubble is larger."""
    S, M, V = p.n_devices, p.n_micro, p.virtual
    return {"interleaved": (S - 1) / (V * M), "zb-h1": (S - 1) / (3 * M)}.get(p.name, (S - 1) / M)


def formula_share(p):
    """The bubble as this package states it, the idle share of the step (idle device time over all
    device time), for unit durations: formula(p) r as r / (1 + r), (p-1)/(m+p-1) for GPipe and 1F1B."""
    r = formula(p)
    return r / (1 + r)


def held(p, sizes=None, per="device", until=None, since="F"):
    """Per device (per="device") or stage ("stage"), the most micro-batches (or examples, micro-batch
    m counting sizes[m]) held at once: `since` done, `until` not yet (default: from the forward to the
    phase that frees them here, W, or an unsplit B). Interleaved counts a chunk's micro-batch as one (a chunk holds
    1/V of a device's layers). ZB-H1 holds S on every stage until W, at most S - s until B."""
    sizes, frees = sizes or [1] * p.n_micro, until or ("W" if p.split else "B")
    n = p.n_devices if per == "device" else p.n_stages
    now, peak = [0] * n, [0] * n
    for order in p.orders:
        for phase, k, m in order:
            i = k % p.n_devices if per == "device" else k
            now[i] += sizes[m] if phase == since else -sizes[m] if phase == frees else 0
            peak[i] = max(peak[i], now[i])
    return peak


def timeline(p, times):
    """Per device, one line of its actions in time order, a cell per time unit ("." idle, "-" the
    rest of a longer action): F3 is micro-batch 3's forward; interleaved adds the chunk, F3c1."""
    span = int(round(max(end for _, end in times.values())))
    lines = []
    for d, order in enumerate(p.orders):
        cells = ["."] * span
        for a in order:
            start, end = (int(round(t)) for t in times[a])
            chunk = f"c{a[1] // p.n_devices}" if p.virtual > 1 else ""
            cells[start:end] = [f"{a[0]}{a[2]}{chunk}"] + ["-"] * (end - start - 1)
        width = max(map(len, cells))
        lines.append(f"device {d}: " + " ".join(c.ljust(width) for c in cells).rstrip())
    return lines


def dry_run(name, n_devices, n_micro, virtual=1):
    """The text a --dry-run prints for schedule `name`: each device's timeline, the micro-batches
    it holds at its peak, the simulated bubble and the formula's."""
    p = plan(name, n_devices, n_micro, virtual)
    times = simulate(p)
    share, ratio = bubbles(p, times)
    costs = " ".join(f"{k}={v:g}" for k, v in unit_durations(p).items())
    head = (f"{name}: {n_devices} devices, {n_micro} micro-batches" +
            (f", {virtual} chunks a device (stage k on device k % {n_devices})" if virtual > 1 else "") +
            f"; durations {costs}" + ("" if p.split else " (B is the whole backward)"))
    return "\n".join([head] + timeline(p, times) + [
        f"peak held (micro-batches{' x chunks' if virtual > 1 else ''}): {held(p)}" +
        (f" until W, {held(p, until='B')} until B" if p.split else ""),
        f"bubble (idle share of the step): {share:.3f} simulated, formula {formula_share(p):.3f}; "
        f"the papers' ratio, idle over compute: {ratio:.3f} simulated, formula {formula(p):.3f}"])


def clock(orders):
    """Per-stage (phase, micro-batch) `orders` (one stage a device, F and B) as clock ticks: the
    actions that the simulation with every action one tick long starts at the same time."""
    n_micro = 1 + max(m for order in orders for _, m in order)
    p = Plan("clock", len(orders), n_micro, 1, tuple(tuple((ph, s, m) for ph, m in o) for s, o in enumerate(orders)))
    times = simulate(p, {"F": 1, "B": 1})
    return [sorted((a for a in times if times[a][0] == t), key=lambda a: a[1]) for t in range(int(max(
        end for _, end in times.values())))]


def schedule(name, n_stages, n_micro):
    """The clock ticks of "gpipe" or "1f1b" for n_stages stages, n_micro micro-batches."""
    return clock(stage_orders(name, n_stages, n_micro))


def bubble_fraction(ticks, n_stages):
    """Share of (tick, stage) slots in which a stage idles, if every slot takes the same time."""
    busy = sum(len(tick) for tick in ticks)
    return 1 - busy / (len(ticks) * n_stages)


def held_peaks(ticks, n_stages, sizes):
    """Per stage, the most examples whose activations it holds at once (forward done, backward
    not yet), micro-batch m being sizes[m] examples."""
    peak_now, peak = [0] * n_stages, [0] * n_stages
    for tick in ticks:
        for phase, s, m in tick:
            peak_now[s] += sizes[m] if phase == "F" else -sizes[m]
            peak[s] = max(peak[s], peak_now[s])
    return peak
