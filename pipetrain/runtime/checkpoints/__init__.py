"""pipetrain.runtime.checkpoints."""
