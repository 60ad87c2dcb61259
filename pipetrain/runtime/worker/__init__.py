"""pipetrain.runtime.worker.main."""
