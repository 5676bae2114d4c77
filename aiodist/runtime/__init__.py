"""The runtime under everything: the loop thread of the blocking faces, busy polling, host facts,
the log level from the environment. Imports nothing of aiodist but ``errors``."""
