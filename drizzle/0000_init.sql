CREATE TABLE "orders" (
	"id" text PRIMARY KEY NOT NULL,
	"amount" bigint NOT NULL,
	"currency" text NOT NULL,
	"customer_id" text NOT NULL,
	"payment_method" text NOT NULL,
	"status" text DEFAULT 'confirmed' NOT NULL,
	"confirmed_at" timestamp with time zone DEFAULT now() NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"updated_at" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "orders_status_check" CHECK ("orders"."status" in ('confirmed'))
);
--> statement-breakpoint
CREATE TABLE "payment_operations" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"order_id" text NOT NULL,
	"kind" text DEFAULT 'charge' NOT NULL,
	"amount" bigint NOT NULL,
	"currency" text NOT NULL,
	"customer_id" text NOT NULL,
	"payment_method" text NOT NULL,
	"status" text DEFAULT 'pending' NOT NULL,
	"external_id" text,
	"attempts" integer DEFAULT 0 NOT NULL,
	"first_attempted_at" timestamp with time zone,
	"last_error" text,
	"last_outcome" text,
	"review_reason" text,
	"needs_review" boolean GENERATED ALWAYS AS (review_reason is not null) STORED NOT NULL,
	"settled_at" timestamp with time zone,
	"fence" bigint DEFAULT 0 NOT NULL,
	"lease_owner" text,
	"lease_expires_at" timestamp with time zone,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"updated_at" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "payment_operations_order_id_kind_key" UNIQUE("order_id","kind"),
	CONSTRAINT "payment_operations_kind_check" CHECK ("payment_operations"."kind" in ('charge')),
	CONSTRAINT "payment_operations_status_check" CHECK ("payment_operations"."status" in ('pending', 'unknown', 'succeeded', 'failed')),
	CONSTRAINT "payment_operations_amount_check" CHECK ("payment_operations"."amount" > 0),
	CONSTRAINT "payment_operations_settled_check" CHECK (("payment_operations"."status" in ('succeeded', 'failed')) = ("payment_operations"."settled_at" is not null))
);
--> statement-breakpoint
ALTER TABLE "payment_operations" ADD CONSTRAINT "payment_operations_order_id_orders_id_fk" FOREIGN KEY ("order_id") REFERENCES "public"."orders"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
CREATE INDEX "payment_operations_unsettled_idx" ON "payment_operations" USING btree ("created_at") WHERE "payment_operations"."status" in ('pending', 'unknown');--> statement-breakpoint
CREATE INDEX "payment_operations_review_idx" ON "payment_operations" USING btree ("updated_at") WHERE "payment_operations"."review_reason" is not null;