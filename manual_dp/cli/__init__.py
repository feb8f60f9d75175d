"""The command line around the library: flags (options), what it prints and writes (output), and
one run from flags to checkpoints (run). The entry point is manual_dp.train."""
