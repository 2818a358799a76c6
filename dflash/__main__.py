"""`python -m dflash ...` and `accelerate launch -m dflash train ...` enter here."""

from dflash.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
