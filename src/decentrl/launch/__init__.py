"""decentrl.launch"""
