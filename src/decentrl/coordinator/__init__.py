"""decentrl.coordinator"""
