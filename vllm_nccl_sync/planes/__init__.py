"""planes"""
