// The kinds a process carries out, registered by name (River's Workers and AddWorker). The engine receives
// one of these and looks every operation's kind up in it; it never imports a kind. Each kind's policy on
// an outcome nobody knows (docs/architecture.md §8):
//
//   policy                   on an ambiguous outcome
//   idempotent-key           resend with the same key inside the window; past it, reconcile (never
//                            create); zero or several → a person (the built-in Stripe kinds, src/kinds/)
//   at-least-once            execute again; the possible duplicate is counted
//   reconcile-before-retry   the kind's check first: done → succeeded, not done → execute again,
//                            unknown → a person (at-least-once and this: an application's kinds)
import type { Kind, KindRegistry } from '../types/kind.ts';

export type { CallContext, EffectCall, EffectCalls, Kind, KindRegistry } from '../types/kind.ts';
export type { Policy } from '../types/status.ts';

export class Kinds implements KindRegistry {
  readonly #byName = new Map<string, Kind>();

  constructor(kinds: Iterable<Kind> = []) {
    for (const kind of kinds) this.add(kind);
  }

  /** Registers a kind; a name is registered once. */
  add(kind: Kind): this {
    if (this.#byName.has(kind.kind)) throw new Error(`kind ${kind.kind} is registered twice`);
    this.#byName.set(kind.kind, kind);
    return this;
  }

  get(kind: string): Kind | undefined {
    return this.#byName.get(kind);
  }

  get names(): readonly string[] {
    return [...this.#byName.keys()];
  }

  /** The kinds whose ambiguous outcomes the reconcile sweep settles through the provider (read-only). */
  get reconciled(): readonly string[] {
    return [...this.#byName.values()].filter((k) => k.policy === 'idempotent-key').map((k) => k.kind);
  }
}
