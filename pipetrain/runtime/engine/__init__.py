"""pipetrain.runtime.engine."""
