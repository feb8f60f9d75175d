"""The command line around the library: flags (options), what it prints and writes (output), and
one run from flags to checkpoints (run). The entry point is manual_dp.train.

    options.py      the flags, built from config.RunConfig: one flag per field, in its group, its default and help
    config_file.py  --config FILE.toml read into those fields; a run's resolved settings written beside it
    build.py        what a run is made of: contexts, network, precision, strategy (build_model), lr, --dry-run
    run.py          one training run: devices, data, strategy, resume, then an epoch at a time
    saving.py       checkpoints during a run: every N updates mid-epoch, at --max-steps, from a thread of their own
    paths.py        a run's output paths checked before training (where their symlinks lead, too long, clobbered)
    output.py       what the command line shows and writes: progress bar, one line per epoch, the JSON log
    text.py         what a language model's run adds: its share of the peak (MFU), a sample at the end
    memcheck.py     memory before training: this run's peak per context, and --memory-per-device
    memprobe.py     one run's memory report per context, measured in a fresh process
"""
