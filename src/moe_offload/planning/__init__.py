"""Planning: records + budget + policy -> Plan, a pure function of its inputs.

placement (the plan as data), accounting (the one definition of bytes a token reads), planner (the
function), frequency (expert-granular placement from routing statistics), tiers (the host / disk cut).
May import: errors, formats, model.
"""
