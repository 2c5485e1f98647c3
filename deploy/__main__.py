"""`python -m deploy ...` is `gpupool ...` (for checkouts where the console script is absent)."""

from deploy.cli import main

main()
