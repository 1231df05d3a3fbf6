"""The executor's side of one step, for the executor service and the in-process engine
alike: the running set it applies the step message to, and the StepBatch that makes.
See docs/ARCHITECTURE.md, "One step"."""
