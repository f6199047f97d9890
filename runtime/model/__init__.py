"""The decoder: model spec, checkpoint loader, layers."""
