"""kvslim.cli, the top floor: the `compress` and `kvslim-lm-eval` commands and `make demo`. The one package that imports all the others; each command parses flags, calls the library and prints."""
