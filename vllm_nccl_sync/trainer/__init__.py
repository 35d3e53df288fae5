"""The trainer side: the push client, its bucket lane and control rounds, and the drivers over it."""
