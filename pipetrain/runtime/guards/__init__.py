"""pipetrain.runtime.guards."""
