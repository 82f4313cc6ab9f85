"""The env server role (`decentrl envd`): live episodes of served environments, signed turn by turn."""
