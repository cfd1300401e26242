"""A faithful, fast, readable reproduction of "Attention Is All You Need" (Vaswani et al., 2017)."""
