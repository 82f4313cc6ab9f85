"""decentrl.eval"""
