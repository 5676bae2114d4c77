"""The runtime under everything: the loop thread of the blocking faces, busy polling, host facts,
periodic progress reports while something waits, the log level from the environment. Imports
nothing of aiodist but ``errors``."""
