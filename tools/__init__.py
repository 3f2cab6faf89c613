"""verl_moe.tools"""
