"""The engine side: one worker's session, its receiver, and what it checks and reports."""
