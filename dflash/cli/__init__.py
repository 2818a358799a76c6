"""The command line (`main`: `dflash train | config | generate | features | eval | export | plot`), the
dry run (`dry_run`) and the key listing (`config_keys`). The top of the stack: nothing imports it."""

from dflash.cli.main import main

__all__ = ["main"]
