"""Leaf helpers: errors, logging, timers, seeding. Imports nothing else of dapo_mcore."""
