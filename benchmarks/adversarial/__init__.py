"""Hostile workers against a real coordinator: the arena, the attack catalogue, `decentrl bench adversarial`."""
