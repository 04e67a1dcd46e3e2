"""`fluidserve profile`: the white-box characterization of the engine on this machine (it also
feeds the simulator's CPU cost model)."""
