"""What the served model needs and what a step costs on a device.

``model_spec`` (a model's shape) and ``device`` (a device's operator coefficients, with
``engine_overhead``: how a serving engine runs a step's kernels) are the inputs; ``memory``
sizes the KV pool from them; ``cost_model`` prices a StepPlan; ``step_timer`` is the slot the
simulator asks for a step's duration (the cost model predicts it, realexec's executor
measures it); ``api_server`` is the serving front end's shared time, outside the engine loop.
"""
