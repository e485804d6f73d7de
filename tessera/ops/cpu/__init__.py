"""Hand-written CPU kernels (C, compiled once on first use) behind registry builders."""
