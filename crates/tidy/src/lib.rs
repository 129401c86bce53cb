//! The workspace's size rules, measured: how long each source file is and how long each
//! function is, from Rust parsed by `syn` (so braces in strings, comments and macros do not
//! fool it). `tests/tidy.rs` applies the limits to `crates/*/src` with its allow-list.
//!
//! A function's length is counted from the line of its `fn` keyword (doc comments and
//! attributes aside) to the line of its body's closing brace. Every function counts: free
//! functions, methods, trait methods with a body, functions nested in functions, and those in
//! `#[cfg(test)]` modules. Functions inside macro invocations (`macro_rules!` bodies,
//! `proptest!`) are not parsed and not counted.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use syn::spanned::Spanned;
use syn::visit::Visit;

/// Longest source file allowed, in lines.
pub const FILE_LINES_MAX: usize = 600;
/// Longest function allowed, in lines.
pub const FUNCTION_LINES_MAX: usize = 70;

/// One function and its length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// Its name qualified by the modules, impl types and functions around it inside the
    /// file: `Pool::open`, `tests::reopen_keeps_data`, `run::helper`.
    pub name: String,
    /// Line of its `fn` keyword (1-based).
    pub line: usize,
    /// Lines from the `fn` keyword to the closing brace, both included.
    pub line_count: usize,
}

/// The functions of one file's source text, in the order they appear (nested ones after
/// the function holding them).
pub fn functions(source: &str) -> Result<Vec<Function>, syn::Error> {
    let file = syn::parse_file(source)?;
    let mut visitor = Collector::default();
    visitor.visit_file(&file);
    Ok(visitor.functions)
}

/// The number of lines of `source` (a last line without a newline counts).
pub fn line_count(source: &str) -> usize {
    source.lines().count()
}

/// Every `.rs` file under `dir`, sorted, recursively.
pub fn rust_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|extension| extension == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

#[derive(Default)]
struct Collector {
    /// Names of the modules, impl types and functions being visited.
    scope: Vec<String>,
    functions: Vec<Function>,
}

impl Collector {
    fn function(&mut self, name: &syn::Ident, fn_token: &syn::token::Fn, body: &syn::Block) {
        let first = fn_token.span().start().line;
        let last = body.brace_token.span.close().end().line;
        assert!(last >= first, "{name}: body ends before it starts");
        let mut qualified = self.scope.clone();
        qualified.push(name.to_string());
        self.functions.push(Function {
            name: qualified.join("::"),
            line: first,
            line_count: last - first + 1,
        });
    }

    fn scoped(&mut self, name: String, visit: impl FnOnce(&mut Self)) {
        self.scope.push(name);
        visit(self);
        self.scope.pop();
    }
}

/// The last segment of an impl's self type: `Pool` for `impl<T> crate::Pool<T>`.
fn type_name(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Path(path) => path
            .path
            .segments
            .last()
            .map_or_else(|| "_".to_string(), |segment| segment.ident.to_string()),
        syn::Type::Reference(reference) => type_name(&reference.elem),
        _ => "_".to_string(),
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        self.function(&item.sig.ident, &item.sig.fn_token, &item.block);
        self.scoped(item.sig.ident.to_string(), |this| {
            syn::visit::visit_block(this, &item.block)
        });
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        self.function(&item.sig.ident, &item.sig.fn_token, &item.block);
        self.scoped(item.sig.ident.to_string(), |this| {
            syn::visit::visit_block(this, &item.block)
        });
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if let Some(body) = &item.default {
            self.function(&item.sig.ident, &item.sig.fn_token, body);
            self.scoped(item.sig.ident.to_string(), |this| {
                syn::visit::visit_block(this, body)
            });
        }
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        self.scoped(type_name(&item.self_ty), |this| {
            syn::visit::visit_item_impl(this, item)
        });
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        self.scoped(item.ident.to_string(), |this| {
            syn::visit::visit_item_trait(this, item)
        });
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.scoped(item.ident.to_string(), |this| {
            syn::visit::visit_item_mod(this, item)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_run_from_fn_to_the_closing_brace_ignoring_braces_in_strings_and_comments() {
        let source = r#"
/// Doc comments are not counted.
#[inline]
pub fn short() -> &'static str {
    // } a brace in a comment
    "} a brace in a string {"
}

struct Pool;

impl Pool {
    fn open() {
        fn nested() {}
        let _ = '}';
    }
}

trait Shape {
    fn declared(&self);
    fn given(&self) {
    }
}

mod tests {
    fn case() {}
}
"#;
        let found = functions(source).unwrap();
        let summary: Vec<(&str, usize, usize)> = found
            .iter()
            .map(|f| (f.name.as_str(), f.line, f.line_count))
            .collect();
        assert_eq!(
            summary,
            [
                ("short", 4, 4),
                ("Pool::open", 12, 4),
                ("Pool::open::nested", 13, 1),
                ("Shape::given", 20, 2),
                ("tests::case", 25, 1),
            ]
        );
    }

    #[test]
    fn a_file_that_does_not_parse_is_an_error() {
        assert!(functions("fn broken( {").is_err());
    }

    #[test]
    fn line_count_counts_a_last_line_without_newline() {
        assert_eq!(line_count("a\nb"), 2);
        assert_eq!(line_count("a\nb\n"), 2);
        assert_eq!(line_count(""), 0);
    }
}
