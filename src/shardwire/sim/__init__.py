"""Predict a sharded training step on any cluster: the model behind ``shardwire simulate`` and
``shardwire plan``. Pure Python (no torch), so it runs anywhere, at once.

    from shardwire.sim import load_spec, predict

    p = predict(load_spec("model", "t5-11b"), load_spec("cluster", "ibm-a100-ethernet"),
                load_spec("training", "ibm-t5-11b-batch50-sliding"))
    p.step_time_s, p.exposed_comm_s, p.memory.fits

specs, presets, inputs   what is simulated, the named ones, and reading them from the command line
huggingface              a Hugging Face config.json as a model, read without torch
architecture             a model's units: parameters, FLOPs, activation bytes, kernels
compute, calibrate       how long a unit's kernels take on a GPU; fitting that to a profile of one GPU
costs                    what a collective costs on a cluster's two network levels
events, step             the discrete-event core, and one step of the engine on it
memory                   peak memory per GPU, and whether it fits
predict, explain         a prediction, a sweep, and why the step takes what it takes
planner                  the fastest settings that fit
report, *_cli            the commands' output
"""

from shardwire.sim.inputs import load_spec
from shardwire.sim.planner import plan
from shardwire.sim.predict import predict, sweep

__all__ = ["load_spec", "plan", "predict", "sweep"]
