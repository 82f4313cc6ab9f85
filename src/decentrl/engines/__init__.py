"""decentrl.engines"""
