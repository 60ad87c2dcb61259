"""pipetrain.runtime.process."""
