//! Refusing a grammar with no finite sentence: a Lark grammar whose `start` needs itself again
//! in every rule (`start: "{" start "}"`) compiles, and its first tokens pass; then the output
//! it forces never ends and llguidance's parser gives up past its item limit, a failure a few
//! tokens in. No output satisfies such a grammar, so it is the client's error before the
//! request starts, as a grammar whose first token mask is empty is.
//!
//! The check reads the grammar llguidance compiled (its rules after parsing the Lark text and
//! any `%json` / sub-grammar it inlines) and computes the productive symbols, the standard
//! least fixed point: terminals (lexemes), nullable symbols and references to nested grammars
//! are productive; a nonterminal is productive once one of its rules has only productive
//! symbols. It refuses only when `start` is certainly not productive: a parametric grammar
//! (whose rules hold conditions) is not checked. A lexeme that matches nothing counts as
//! productive (llguidance refuses those at the first token mask).

use std::collections::VecDeque;

use llguidance::earley::{CGrammar, CSymIdx};

/// Most names of symbols with no finite sentence that a refusal lists.
const MAX_NAMED: usize = 4;

/// `Err` with the reason when `grammar`'s start symbol derives no finite sentence.
pub(crate) fn check_finite_sentence(grammar: &CGrammar) -> Result<(), String> {
    if grammar.parametric() {
        return Ok(());
    }
    // The symbols reachable from the start (a grammar has fewer than 2^16), and for each
    // one the rules it occurs in, once per occurrence.
    let start = grammar.start();
    let mut seen = vec![false; usize::from(u16::MAX) + 1];
    let mut order: Vec<CSymIdx> = Vec::new();
    seen[start.as_index()] = true;
    order.push(start);
    let mut next = 0;
    // Per rule (numbered in discovery order): its left-hand side and how many of its right-hand
    // symbols are not known productive yet.
    let mut rules: Vec<(CSymIdx, usize)> = Vec::new();
    let mut occurs: Vec<Vec<usize>> = vec![Vec::new(); seen.len()];
    while let Some(&sym) = order.get(next) {
        next += 1;
        for &rule in grammar.rules_of(sym) {
            let (rhs, _, _) = grammar.rule_rhs(rule);
            let id = rules.len();
            rules.push((sym, rhs.len()));
            for &elt in rhs {
                occurs[elt.as_index()].push(id);
                if !seen[elt.as_index()] {
                    seen[elt.as_index()] = true;
                    order.push(elt);
                }
            }
        }
    }
    let mut productive = vec![false; seen.len()];
    let mut work: VecDeque<CSymIdx> = VecDeque::new();
    for &sym in &order {
        let data = grammar.sym_data(sym);
        if data.is_terminal || data.is_nullable || data.gen_grammar.is_some() {
            productive[sym.as_index()] = true;
            work.push_back(sym);
        }
    }
    while let Some(sym) = work.pop_front() {
        for &id in &occurs[sym.as_index()] {
            let (lhs, missing) = &mut rules[id];
            *missing -= 1;
            if *missing == 0 && !productive[lhs.as_index()] {
                productive[lhs.as_index()] = true;
                work.push_back(*lhs);
            }
        }
    }
    if productive[start.as_index()] {
        return Ok(());
    }
    let others: Vec<String> = order
        .iter()
        .skip(1)
        .filter(|s| !productive[s.as_index()])
        .take(MAX_NAMED)
        .map(|&s| format!("`{}`", grammar.sym_name(s)))
        .collect();
    let others = if others.is_empty() {
        String::new()
    } else {
        format!(" (nor can {})", others.join(", "))
    };
    Err(format!(
        "no finite output satisfies it: every rule of `{}` needs a symbol that never ends{others}; \
         a recursion needs an alternative that leads out of it",
        grammar.sym_name(start)
    ))
}
