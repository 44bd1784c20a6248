"""Redundant computation: who holds which stage and replica, and how failover reassigns them."""
