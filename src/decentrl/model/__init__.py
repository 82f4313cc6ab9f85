"""decentrl.model"""
