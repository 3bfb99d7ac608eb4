"""Verifiers that turn a response and a reference answer into correct / wrong."""
