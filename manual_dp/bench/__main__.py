"""`python -m manual_dp.bench`: see manual_dp.bench.command."""
from .command import main

main()
