"""Lightning plugins the strategies use, laid out as Lightning lays out its own (``plugins/precision``)."""
