"""Quantisation: MX block formats (MXFP4 / MXFP8, E8M0 scales), fake quantisation with a
straight-through gradient, and the release byte packing (docs/maths.md §7)."""
