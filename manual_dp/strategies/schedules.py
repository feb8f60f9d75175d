"""The orders in which pipeline stages run forwards (F) and backwards (B) of micro-batches: GPipe and
1F1B, as clock ticks; the idle share (bubble) and the activations each stage holds at its peak.

A stage keeps a micro-batch's activations from its forward until its backward. GPipe runs every
forward first, so every stage holds all M micro-batches at once. 1F1B (PipeDream-flush) lets stage
s run only S - 1 - s forwards ahead, then alternates one forward and one backward: it holds at
most S - s micro-batches, with the same ticks and the same bubble (docs/design.md draws both).
"""
SCHEDULES = ("gpipe", "1f1b")


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


def stage_orders(name, n_stages, n_micro):
    """Per stage, the sequence of (phase, micro-batch) it runs under schedule `name`."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose from {', '.join(SCHEDULES)}")
    orders = []
    for s in range(n_stages):
        if name == "gpipe":
            orders.append([("F", m) for m in range(n_micro)] + [("B", m) for m in reversed(range(n_micro))])
            continue
        warm = min(n_stages - 1 - s, n_micro)          # forwards run ahead before the first backward
        order = [("F", m) for m in range(warm)]
        for m in range(n_micro - warm):                 # steady state: one forward, one backward
            order += [("F", warm + m), ("B", m)]
        orders.append(order + [("B", m) for m in range(n_micro - warm, n_micro)])
    return orders


def ready(action, done, n_stages):
    """True if what `action` needs ran in an earlier tick: F the previous stage's F, B the next's B."""
    phase, s, m = action
    if phase == "F":
        return s == 0 or ("F", s - 1, m) in done
    return s == n_stages - 1 or ("B", s + 1, m) in done


def clock(orders):
    """The per-stage `orders` as clock ticks: each tick every stage runs its next action if ready."""
    n, pos, done, ticks = len(orders), [0] * len(orders), set(), []
    while any(p < len(o) for p, o in zip(pos, orders)):
        tick = [(orders[s][pos[s]][0], s, orders[s][pos[s]][1]) for s in range(n) if pos[s] < len(orders[s])]
        tick = [a for a in tick if ready(a, done, n)]
        if not tick:
            raise ValueError("the orders wait on each other: no stage can run")
        for action in tick:
            done.add(action)
            pos[action[1]] += 1
        ticks.append(tick)
    return ticks


def schedule(name, n_stages, n_micro):
    """The clock ticks of schedule `name` ("gpipe" or "1f1b") for n_stages stages, n_micro micro-batches."""
    return clock(stage_orders(name, n_stages, n_micro))


def bubble_fraction(ticks, n_stages):
    """Share of (tick, stage) slots in which a stage idles, if every slot takes the same time."""
    busy = sum(len(tick) for tick in ticks)
    return 1 - busy / (len(ticks) * n_stages)


def held_peaks(ticks, n_stages, sizes):
    """Per stage, the most examples whose activations it holds at once (forward done, backward
    not yet), micro-batch m being sizes[m] examples."""
    held, peak = [0] * n_stages, [0] * n_stages
    for tick in ticks:
        for phase, s, m in tick:
            held[s] += sizes[m] if phase == "F" else -sizes[m]
            peak[s] = max(peak[s], held[s])
    return peak
