//! The metric registry handle every component registers its own families in.
//!
//! The server serves one Prometheus registry on `/metrics`. The runtime's parts, each backend
//! and each layer own their families: they register them here when they are built, through
//! [`MetricsRegistry::registry`] (families of one instance) or [`MetricsRegistry::shared`]
//! (families several instances share: two SSD tiers, a layer wrapped around several tiers,
//! families the runtime registers up front so that they are served before any instance
//! exists). Nothing here knows a metric's name.
//!
//! Must never: register one family twice (Prometheus refuses a duplicate name: the second
//! component would lose its family), or make a component depend on another's families.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// A handle on the server's metric registry; clones share it.
#[derive(Clone, Default)]
pub struct MetricsRegistry {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    registry: prometheus::Registry,
    shared: Mutex<HashMap<TypeId, Box<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for MetricsRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsRegistry")
            .field("families", &self.inner.registry.gather().len())
            .finish()
    }
}

impl MetricsRegistry {
    /// An empty registry (a test's, or the server's before any component registered).
    pub fn new() -> Self {
        Self::default()
    }

    /// The Prometheus registry: a component registers the families only it owns here, once,
    /// when it is built.
    pub fn registry(&self) -> &prometheus::Registry {
        &self.inner.registry
    }

    /// The families of type `T`, shared by every caller: `make` builds and registers them the
    /// first time `T` is asked for; later callers get a clone of the same families (a
    /// Prometheus family handle is a shared reference: a clone counts into the same series).
    /// `T` is typically a struct of families with a `fn register(&Registry) -> Self`.
    ///
    /// # Panics
    /// Only if `make` panics (a family whose name another component registered already, a
    /// bug that the first scrape in the tests shows).
    pub fn shared<T, F>(&self, make: F) -> T
    where
        T: Clone + Send + Sync + 'static,
        F: FnOnce(&prometheus::Registry) -> T,
    {
        let mut shared = self.inner.shared.lock();
        if let Some(v) = shared.get(&TypeId::of::<T>()) {
            return v
                .downcast_ref::<T>()
                .expect("keyed by its own type id")
                .clone();
        }
        let v = make(&self.inner.registry);
        shared.insert(TypeId::of::<T>(), Box::new(v.clone()));
        v
    }

    /// Every family in the Prometheus text format, as `/metrics` serves it.
    pub fn render(&self) -> String {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        let _ = prometheus::TextEncoder::new().encode(&self.inner.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct Fams(prometheus::IntCounter);

    fn register(r: &prometheus::Registry) -> Fams {
        let c = prometheus::IntCounter::new("t_shared_total", "a shared counter").unwrap();
        r.register(Box::new(c.clone())).unwrap();
        Fams(c)
    }

    #[test]
    fn shared_families_are_built_once_and_count_together() {
        let m = MetricsRegistry::new();
        let a = m.shared(register);
        let b = m.clone().shared(|_| -> Fams { panic!("built twice") });
        a.0.inc();
        b.0.inc_by(2);
        assert!(m.render().contains("t_shared_total 3"), "{}", m.render());
    }
}
