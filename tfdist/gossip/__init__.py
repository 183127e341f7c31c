"""Stochastic Gradient Push runtime: graph schedules, messages, the courier."""
