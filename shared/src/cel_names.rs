//! What a CEL expression names: the variables it uses from outside (a
//! comprehension's own variables, such as `x` in `l.exists(x, x > 1)`, are
//! not among them), and the fields it reads by name off one of them
//! (`reported.x`, `reported['x']`, `has(reported.x)`).

use std::collections::BTreeSet;

use cel::IdedExpr;
use cel::common::ast::{EntryExpr, Expr, LiteralValue};

/// The names in an expression.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Names {
    /// The variables it takes from its context.
    pub free: BTreeSet<String>,
    /// The fields it reads off the variable asked about.
    pub fields: BTreeSet<String>,
}

/// The names in `expr`, with the fields it reads off the variable `of`.
pub(crate) fn names(expr: &IdedExpr, of: &str) -> Names {
    let mut walk = Walk {
        of,
        bound: Vec::new(),
        names: Names::default(),
    };
    walk.expr(expr);
    walk.names
}

/// CEL's index operator, `m[k]`.
const INDEX: &str = "_[_]";

struct Walk<'a> {
    of: &'a str,
    /// The comprehension variables in scope.
    bound: Vec<&'a str>,
    names: Names,
}

impl<'a> Walk<'a> {
    /// Whether `e` is the variable asked about (not a comprehension
    /// variable of the same name).
    fn is_of(&self, e: &IdedExpr) -> bool {
        matches!(&e.expr, Expr::Ident(n) if n == self.of && !self.bound.contains(&n.as_str()))
    }

    fn expr(&mut self, e: &'a IdedExpr) {
        match &e.expr {
            Expr::Ident(name) => {
                // `@`-names are the parser's own, for expanded macros.
                if !name.starts_with('@') && !self.bound.contains(&name.as_str()) {
                    self.names.free.insert(name.clone());
                }
            }
            Expr::Select(select) => {
                if self.is_of(&select.operand) {
                    self.names.fields.insert(select.field.clone());
                }
                self.expr(&select.operand);
            }
            Expr::Call(call) => {
                if let (INDEX, [map, key]) = (call.func_name.as_str(), call.args.as_slice())
                    && self.is_of(map)
                    && let Expr::Literal(LiteralValue::String(field)) = &key.expr
                {
                    self.names.fields.insert(field.inner().to_owned());
                }
                if let Some(target) = &call.target {
                    self.expr(target);
                }
                call.args.iter().for_each(|a| self.expr(a));
            }
            Expr::Comprehension(c) => {
                self.expr(&c.iter_range);
                self.expr(&c.accu_init);
                let outer = self.bound.len();
                self.bound.push(&c.iter_var);
                self.bound.extend(c.iter_var2.as_deref());
                self.bound.push(&c.accu_var);
                self.expr(&c.loop_cond);
                self.expr(&c.loop_step);
                self.expr(&c.result);
                self.bound.truncate(outer);
            }
            Expr::List(list) => list.elements.iter().for_each(|x| self.expr(x)),
            Expr::Map(map) => map.entries.iter().for_each(|x| self.entry(&x.expr)),
            Expr::Struct(s) => s.entries.iter().for_each(|x| self.entry(&x.expr)),
            Expr::Literal(_) | Expr::Unspecified => {}
        }
    }

    fn entry(&mut self, entry: &'a EntryExpr) {
        match entry {
            EntryExpr::StructField(f) => self.expr(&f.value),
            EntryExpr::MapEntry(m) => {
                self.expr(&m.key);
                self.expr(&m.value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(source: &str) -> Names {
        let program = cel::Program::compile(source).unwrap();
        names(program.expression(), "reported")
    }

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn fields_are_found_wherever_they_are_read() {
        let names = of("has(reported.fan) && reported['power'] > 5.0 \
             && [1, 2].exists(x, reported.setpoint > double(x)) \
             && labels.zone == 'a' && {'k': reported.mode}.k == 'auto'");
        assert_eq!(names.fields, set(&["fan", "mode", "power", "setpoint"]));
        assert_eq!(names.free, set(&["labels", "reported"]));
    }

    #[test]
    fn a_comprehensions_own_variables_are_not_free_and_shadow_outer_ones() {
        let names = of("[1, 2].all(x, x > 0) && [{'a': 1}].exists(reported, reported.a == 1)");
        assert!(names.free.is_empty(), "{:?}", names.free);
        assert!(names.fields.is_empty(), "{:?}", names.fields);
        assert_eq!(of("online").free, set(&["online"]));
    }
}
