"""The ``dsi`` command line: one small module per command group, each a thin layer over the library."""
