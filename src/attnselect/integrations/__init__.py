"""Integrations with frameworks that run attnselect for you (Ray; more to come). Each is an optional extra."""
