"""`python -m nori_jax.bench serve ...`: the load generator without the engine's CLI."""

import sys

from nori_jax.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
