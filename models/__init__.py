"""verl_moe.models"""
