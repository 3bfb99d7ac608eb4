"""Rollout engines behind one Protocol (adapters loaded lazily by name) and the dynamic-sampling sampler."""
