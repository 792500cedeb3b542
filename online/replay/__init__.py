"""Replay of logged traffic: `engine` scores a drafter on greedy traces teacher-forced through the
real engine loop (exact, no target needed); `compare` reads traffic from a store or an export and
scores drafters side by side (`livedraft replay`). Importing the package loads no model code."""
