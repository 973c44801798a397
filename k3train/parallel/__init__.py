"""Parallel layout: the device mesh, logical-axis rule tables, expert and sequence parallelism.

Model code names axes logically (`k3train/model/axes.py`); everything that knows about devices
lives here: `mesh` builds the 5-axis mesh from the `parallel` config section, `rules` maps logical
names to mesh axes (one table per recipe) and holds the active layout, `state_sharding` derives
explicit shardings for parameters, optimizer state and batches, `expert` runs the routed experts
with an all-to-all over the `expert` axis, `sequence` runs KDA with state passing over the
`sequence` axis.
"""
