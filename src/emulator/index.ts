// The emulator's entry: what the rest of the repository (runtime, CLI, tests, scripts) imports.
export { StripeEmulator, type EmulatorOptions } from './emulator.ts';
export { EmulatorServer } from './server.ts';
export { PgState } from './pgState.ts';
export { MemoryState } from './state.ts';
export type { RequestLogEntry, ServerOptions, WebhookDelivery } from './core.ts';
export type { SettleStatus } from './resources.ts';
export type { EmulatedEvent, Endpoint, Fault, FaultRule, LedgerEntry, PaymentIntent, Refund, RefundEntry, RefundStatus, WebhookTarget } from './state.ts';
