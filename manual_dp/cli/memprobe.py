"""`python -m manual_dp.cli.memprobe CONFIG_JSON KIND N`: one run's memory report per context,
measured in this fresh process (manual_dp.cli.memcheck starts it), printed as one JSON line."""
import json
import sys

from ..config import RunConfig
from ..fast.runtime import configure


def main(argv):
    """Prints the report of the RunConfig given as JSON, on contexts cpu|gpu(0..N-1)."""
    fields, kind, n = json.loads(argv[0]), argv[1], int(argv[2])
    configure(n if kind == "cpu" else 0)
    import mxnet as mx                                            # loads with the settings above
    from .memcheck import measure_run
    from .build import build_model, network
    cfg = RunConfig(**fields)
    ctx = [mx.cpu(i) if kind == "cpu" else mx.gpu(i) for i in range(n)]
    params = network(cfg).init_params(cfg.seed, cfg.init_scale)
    print(json.dumps(measure_run(cfg, params, ctx, build_model)))


if __name__ == "__main__":
    main(sys.argv[1:])
