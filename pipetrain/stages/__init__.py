"""pipetrain.stages."""
